"""A diffusers training loop in the shape of its example scripts (examples/unconditional_image_generation/
train_unconditional.py): a tiny `UNet2DModel` from a config, `DDPMScheduler`, `EMAModel` (warm-up decay), the
save/load hooks registered with `accelerator.register_save_state_pre_hook` / `register_load_state_pre_hook` (they
write unet/ and unet_ema/ with `save_pretrained`, and read them back with `from_pretrained`), gradient clipping on
sync steps, checkpoints every `checkpointing_steps` with rotation (`checkpoints_total_limit`), `save_state` called on
the main process only, and resume from a checkpoint (batches skipped by iterating, as the example does).

Each scenario trains once from scratch (`full`), then again resumed from the oldest checkpoint the rotation kept
(`resumed`, in the same output folder, as a user re-running with --resume_from_checkpoint does).

Scenarios (`--scenarios`, comma-separated):
  ddpm         fp32, gradient accumulation 1, checkpoint every 2 steps, keep 2
  ddpm_accum   gradient accumulation 2, checkpoint every step, keep 2, EMA without warm-up

Rank 0 writes <out>/records.json (per scenario and run: each step's loss, lr, EMA decay; the checkpoint folders and
what is in them) and <out>/<scenario>_<run>.safetensors (unet weights, and the EMA weights under `ema.`)."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import listing, run_scenarios

SETTINGS = {
    "ddpm": dict(gradient_accumulation_steps=1, checkpointing_steps=2, checkpoints_total_limit=2, use_ema_warmup=True),
    "ddpm_accum": dict(gradient_accumulation_steps=2, checkpointing_steps=1, checkpoints_total_limit=2,
                       use_ema_warmup=False),
}


def images(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, 8, 8, generator=g) * 2 - 1
    return [{"input": x[i]} for i in range(n)]


def main(output_dir: Path, resume_from_checkpoint=None, gradient_accumulation_steps=1, checkpointing_steps=2,
         checkpoints_total_limit=2, use_ema_warmup=True, num_epochs=2, train_batch_size=4, learning_rate=1e-3):
    import accelerate
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel
    from packaging import version

    logging_dir = os.path.join(output_dir, "logs")
    accelerator_project_config = ProjectConfiguration(project_dir=str(output_dir), logging_dir=logging_dir)
    accelerator = Accelerator(gradient_accumulation_steps=gradient_accumulation_steps, mixed_precision="no",
                              project_config=accelerator_project_config)

    # `accelerate` 0.16.0 will have better support for customized saving
    hooks = version.parse(accelerate.__version__) >= version.parse("0.16.0")
    if hooks:
        # create custom saving & loading hooks so that `accelerator.save_state(...)` serializes in a nice format
        def save_model_hook(models, weights, output_dir):
            if accelerator.is_main_process:
                ema_model.save_pretrained(os.path.join(output_dir, "unet_ema"))

                for model in models:
                    model.save_pretrained(os.path.join(output_dir, "unet"))

                    # make sure to pop weight so that corresponding model is not saved again
                    weights.pop()

        def load_model_hook(models, input_dir):
            load_model = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DModel)
            ema_model.load_state_dict(load_model.state_dict())
            ema_model.to(accelerator.device)
            del load_model

            for _ in range(len(models)):
                # pop models so that they are not loaded again
                model = models.pop()

                # load diffusers style into model
                load_model = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
                model.register_to_config(**load_model.config)

                model.load_state_dict(load_model.state_dict())
                del load_model

        accelerator.register_save_state_pre_hook(save_model_hook)
        accelerator.register_load_state_pre_hook(load_model_hook)

    set_seed(42)
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)

    # Initialize the model
    model = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                        norm_num_groups=4, attention_head_dim=8, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D"))

    # Create EMA for the model.
    ema_model = EMAModel(model.parameters(), decay=0.9999, use_ema_warmup=use_ema_warmup, inv_gamma=1.0, power=3 / 4,
                         model_cls=UNet2DModel, model_config=model.config)

    noise_scheduler = DDPMScheduler(num_train_timesteps=100, beta_schedule="linear")
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.95, 0.999), weight_decay=1e-6,
                                  eps=1e-08)

    dataset = images(24, 0)
    train_dataloader = torch.utils.data.DataLoader(dataset, batch_size=train_batch_size, shuffle=True)

    lr_scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=2 * accelerator.num_processes,
                                 num_training_steps=(len(train_dataloader) * num_epochs))

    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    ema_model.to(accelerator.device)

    total_batch_size = train_batch_size * accelerator.num_processes * gradient_accumulation_steps
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / gradient_accumulation_steps)
    max_train_steps = num_epochs * num_update_steps_per_epoch
    accelerator.print(f"total batch size {total_batch_size}, {max_train_steps} optimization steps")

    global_step = 0
    first_epoch = 0
    resume_step = 0
    resumed_from = None
    if resume_from_checkpoint:
        if resume_from_checkpoint != "latest":
            path = os.path.basename(resume_from_checkpoint)
        else:
            # Get the most recent checkpoint
            dirs = os.listdir(output_dir)
            dirs = [d for d in dirs if d.startswith("checkpoint")]
            dirs = sorted(dirs, key=lambda x: int(x.split("-")[1]))
            path = dirs[-1] if len(dirs) > 0 else None
        accelerator.print(f"Resuming from checkpoint {path}")
        accelerator.load_state(os.path.join(output_dir, path))
        global_step = int(path.split("-")[1])
        resumed_from = path
        resume_global_step = global_step * gradient_accumulation_steps
        first_epoch = global_step // num_update_steps_per_epoch
        resume_step = resume_global_step % (num_update_steps_per_epoch * gradient_accumulation_steps)

    log = []
    for epoch in range(first_epoch, num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            # Skip steps until we reach the resumed step
            if resume_from_checkpoint and epoch == first_epoch and step < resume_step:
                continue

            clean_images = batch["input"]
            # Sample noise that we'll add to the images
            noise = torch.randn(clean_images.shape, dtype=clean_images.dtype, device=clean_images.device)
            bsz = clean_images.shape[0]
            # Sample a random timestep for each image
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,),
                                      device=clean_images.device).long()
            # Add noise to the clean images according to the noise magnitude at each timestep
            noisy_images = noise_scheduler.add_noise(clean_images, noise, timesteps)

            with accelerator.accumulate(model):
                # Predict the noise residual
                model_output = model(noisy_images, timesteps).sample
                loss = F.mse_loss(model_output.float(), noise.float())
                accelerator.backward(loss)

                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            # Checks if the accelerator has performed an optimization step behind the scenes
            if accelerator.sync_gradients:
                ema_model.step(model.parameters())
                global_step += 1

                if accelerator.is_main_process:
                    if global_step % checkpointing_steps == 0:
                        # _before_ saving state, check if this save would set us over the `checkpoints_total_limit`
                        if checkpoints_total_limit is not None:
                            checkpoints = os.listdir(output_dir)
                            checkpoints = [d for d in checkpoints if d.startswith("checkpoint")]
                            checkpoints = sorted(checkpoints, key=lambda x: int(x.split("-")[1]))

                            # before saving, keep at _most_ `checkpoints_total_limit - 1` checkpoints
                            if len(checkpoints) >= checkpoints_total_limit:
                                num_to_remove = len(checkpoints) - checkpoints_total_limit + 1
                                removing_checkpoints = checkpoints[0:num_to_remove]
                                for removing_checkpoint in removing_checkpoints:
                                    shutil.rmtree(os.path.join(output_dir, removing_checkpoint))

                        save_path = os.path.join(output_dir, f"checkpoint-{global_step}")
                        accelerator.save_state(save_path)

            logs = {"loss": loss.detach().item(), "lr": lr_scheduler.get_last_lr()[0], "step": global_step,
                    "epoch": epoch, "ema_decay": ema_model.cur_decay_value,
                    "loss_mean": accelerator.gather(loss.detach()).mean().item()}
            log.append(logs)
            accelerator.log(logs, step=global_step)
        accelerator.wait_for_everyone()

    unet = accelerator.unwrap_model(model)
    weights = dict(unet.state_dict())
    weights.update({f"ema.{i}": p for i, p in enumerate(ema_model.shadow_params)})
    record = {"log": log, "hooks": hooks, "resumed_from": resumed_from, "num_update_steps_per_epoch":
              num_update_steps_per_epoch}
    accelerator.wait_for_everyone()
    accelerator.free_memory()  # the example ends with end_training(); here the next run follows in this process
    return record, weights


def scenario(name: str):
    def run(out: Path):
        folder = out / "output"
        full, full_weights = main(folder, **SETTINGS[name])
        full["checkpoints"] = {d: listing(folder / d) for d in sorted(os.listdir(folder)) if d.startswith("checkpoint")}
        oldest = min(full["checkpoints"], key=lambda d: int(d.split("-")[1]))
        resumed, resumed_weights = main(folder, resume_from_checkpoint=oldest, **SETTINGS[name])
        return {"full": full, "resumed": resumed}, {"_full": full_weights, "_resumed": resumed_weights}

    return run


if __name__ == "__main__":
    run_scenarios({name: scenario(name) for name in SETTINGS}, __doc__)
