"""The throughput monitor on a data-parallel run: each rank trains STEPS steps on batches of BATCH x SEQ tokens
(the monitor turned on by `accel launch --throughput_monitor`) and writes what its monitor reported to
OUT/rankN.json."""

import json
import sys
from pathlib import Path

import torch

from accel import Accelerator, ThroughputMonitorKwargs

STEPS, BATCH, SEQ, VOCAB = 5, 2, 8, 16
FLOPS_PER_TOKEN, PEAK = 1e6, 1e12

out = Path(sys.argv[1])
accelerator = Accelerator(kwargs_handlers=[ThroughputMonitorKwargs(flops_per_token=FLOPS_PER_TOKEN, peak_flops=PEAK)])
model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.DataLoader([{"input_ids": torch.randint(0, VOCAB, (SEQ,))} for _ in range(64)],
                                   batch_size=BATCH)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for step, batch in enumerate(data):
    if step == STEPS:
        break
    logits = model(batch["input_ids"])
    accelerator.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["input_ids"].flatten()))
    optimizer.step()
    optimizer.zero_grad()
monitor = accelerator.throughput
(out / f"rank{accelerator.process_index}.json").write_text(json.dumps(
    {"steps": monitor.steps, "log_every": monitor.log_every, "metrics": monitor.metrics,
     "data_parallel_size": monitor.data_parallel_size, "num_processes": monitor.num_processes}))
accelerator.end_training()
