"""Where runs go: one job on this node or across a SLURM allocation (`job`, `nodes`), submission to
SLURM through hydra-submitit-launcher (`slurm`), and the summary of a sweep (`sweep`)."""
