"""Test rigs that the tests and benchmarks share, kept out of the installed package
(pyproject's package discovery ships sglang_disagg only): no server ever runs them.

The repository root must be on sys.path to import them: pytest puts it there (pyproject's
`pythonpath`), and a benchmark inserts it itself.
"""
