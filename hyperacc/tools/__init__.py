"""Layer 8: tools built on the library: the dry-run memory planner, YAML/CLI configs and the fail-closed preflight checks."""
