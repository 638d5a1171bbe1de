"""The sink stage: the stage itself and the result store it writes (assembly, group commit)."""
