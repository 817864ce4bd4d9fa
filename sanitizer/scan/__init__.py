"""`hazsan scan`: static scan for scopes that can put transients into a symmetric window.

Parses Python with `ast` only (the scanned code is never imported or run), finds every block
entered through a symmetric-memory scope (scopes.py), classifies what its body allocates,
following helpers defined in the scanned tree (classify.py), applies an allow-list (allow.py),
and, given a trace, marks the scopes that placed transients in a window at run time (runtime.py).
"""
