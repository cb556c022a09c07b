#!/bin/bash
# SLURM without a launcher: srun starts one task per GPU; Accelerator() forms the group from SLURM's variables
# (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the node list's first host, a port from the job id).
#SBATCH --job-name=accel-train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
srun python train.py
