"""2 processes: get_logger's main_process_only / in_order and Accelerate's tqdm, printed to stderr for the test."""

import logging
import sys
import time

from accel import Accelerator
from accel.logging import get_logger
from accel.utils import tqdm

logging.basicConfig(format="%(message)s", stream=sys.stderr)
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
logger = get_logger("logging_worker", log_level="INFO")

logger.info(f"default from rank {rank}")
logger.info(f"everyone from rank {rank}", main_process_only=False)
accelerator.wait_for_everyone()
if rank == 0:
    time.sleep(0.5)  # rank 0 comes late: without the turns rank 1 would print first
for turn in range(2):
    logger.info(f"turn {turn} from rank {rank}", main_process_only=False, in_order=True)
accelerator.wait_for_everyone()
for _ in tqdm(range(3), desc=f"main bar of rank {rank}"):
    pass
for _ in tqdm(range(3), desc=f"every bar of rank {rank}", main_process_only=False):
    pass
accelerator.end_training()
