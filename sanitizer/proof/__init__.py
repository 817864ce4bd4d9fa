"""`hazsan compare`: the statistical proof that a fix removes a hazard (stock run vs fixed run).

See `sanitizer.proof.compare` for the measures and the verdict, `sanitizer.proof.outcomes` for
the outcomes.jsonl format a program under test writes, `sanitizer.proof.stats` for the tests.
"""
from sanitizer.proof.compare import MEASURES, Comparison
from sanitizer.proof.outcomes import Outcome, OutcomeError, read_outcomes
from sanitizer.proof.run import RunError, RunEvidence, load_run
from sanitizer.proof.stats import Rate, fisher

__all__ = ["MEASURES", "Comparison", "Outcome", "OutcomeError", "Rate", "RunError", "RunEvidence",
           "fisher", "load_run", "read_outcomes"]
