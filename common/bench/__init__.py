"""The benchmark matrix and the tools around it (doctor)."""
