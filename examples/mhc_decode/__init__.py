"""DeepSeek-V4-style decode with mHC on the CPU symmetric-memory testbed (stock vs fixed combine).

See model.py (the model and the two mHC variants), decode.py (the speculative verify loop and the
reference check) and run.py (the command line: python -m examples.mhc_decode --help).
"""
