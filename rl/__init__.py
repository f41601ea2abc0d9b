"""Post-training: everything between a prompt and a weight update."""
