"""Tools run from the repository: the memory planner, the copy command, the preflight estimate. Never on a
training path, never copied (shared/tools/cp.py refuses to)."""
