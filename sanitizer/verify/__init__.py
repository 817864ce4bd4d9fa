"""`hazsan verify URL`: is a running SGLang or vLLM server showing the corruption signature?

It puts the right load on the server (sanitizer/verify/load.py, with the prompts of
sanitizer/verify/prompts/), watches acceptance every way the server shows it (its replies, its
/metrics, its log through logscan: sanitizer/verify/observers.py), reads its depth from what it says
about itself (server.py), and judges (verdict.py). docs/cli.md, "hazsan verify".
"""
from sanitizer.verify.session import Options, Result, Session, VerifyError

__all__ = ["Options", "Result", "Session", "VerifyError"]
