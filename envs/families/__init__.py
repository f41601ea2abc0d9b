"""Procedural task families: small-scale RL tasks, terminal tasks, code repair."""
