#!/bin/bash
# SLURM with accel launch: one launcher per node, each starting 4 processes (srun hands it the node's rank).
#SBATCH --job-name=accel-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --signal=B:USR1@120
srun accel launch --num_machines 2 --num_processes 8 train.py
