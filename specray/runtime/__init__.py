"""Distribution: the coordinator, the generation actor, and the store."""
