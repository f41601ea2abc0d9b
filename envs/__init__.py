"""Tasks, sandboxes and verifiers for RL; imports nothing from rl/."""
