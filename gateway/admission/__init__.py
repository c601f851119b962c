"""Admission: the body read within bounds, its parts classified, keys, the plan (the decision)."""
