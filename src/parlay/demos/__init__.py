"""Runnable demos: ``parlay demo NAME -n N [args]`` runs ``python -m parlay.demos.NAME``."""
