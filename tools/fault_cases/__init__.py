"""Fault cases for ``tools/faults.py``: one module per case family, each with
``run(repeats: int, workdir: pathlib.Path) -> list[dict]`` returning one row per try
(``{"case": str, "ok": bool, "detail": str}``)."""
