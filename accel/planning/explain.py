"""A plan in the seed's terms: each layout's family and name, the branch of the decision tree, why the recommended
layout and not the others; and the recommended layout written as an accel config."""

from __future__ import annotations

from accel.planning.estimate import sequence_length
from accel.planning.hardware import Hardware, PlanError
from accel.planning.shape import Shape
from accel.planning.step import USABLE_FRACTION

TIE = 0.02                 # layouts within 2% of the fastest count as equal: the simplest is recommended


def family(row: dict) -> str:
    """The seed's branches: pure data parallelism, ZeRO-3, offload, tensor or pipeline parallelism."""
    if row["offload"]:
        return "ZeRO-3 + offload"
    if row["pp_size"] > 1:
        return "pipeline parallelism"
    if row.get("ep_size", 1) > 1:
        return "expert parallelism"
    if row.get("sp_size", 1) > 1:
        return "sequence parallelism (Ulysses)"
    if row.get("cp_size", 1) > 1:
        return "context parallelism"
    if row["tp_size"] > 1:
        return "tensor parallelism"
    return {0: "DDP", 1: "ZeRO-1/2", 2: "ZeRO-1/2", 3: "ZeRO-3"}[row["zero_stage"]]


def layout_name(row: dict) -> str:
    parts = [f"PP {row['pp_size']}"] if row["pp_size"] > 1 else []
    parts += [row["pp_schedule"]] if row["pp_size"] > 1 and row.get("pp_schedule", "1F1B") != "1F1B" else []
    parts += [f"TP {row['tp_size']}"] if row["tp_size"] > 1 else []
    parts += [f"{name.upper()} {row[name + '_size']}" for name in ("sp", "cp", "ep") if row.get(name + "_size", 1) > 1]
    parts.append("DDP" if row["zero_stage"] == 0 else f"ZeRO-{row['zero_stage']}")
    return " + ".join(parts) + (" + offload" if row["offload"] else "")


def describe(row: dict) -> str:
    t = "" if row["step_time_s"] is None else f"{row['step_time_s']:.3g} s/step"
    batches = (f"{row['micro_batches']} micro-batches of {row['micro_batch_size']}" if row["pp_size"] > 1 else
               f"gradient accumulation {row['micro_batches']} x {row['micro_batch_size']}"
               if row["micro_batches"] > 1 else f"batch {row['micro_batch_size']}")
    seq = "".join(f", {name} {row[name + '_size']}" for name in ("sp", "cp", "ep") if row.get(name + "_size", 1) > 1)
    return (f"{layout_name(row)} (dp {row['dp_size']}, tp {row['tp_size']}, pp {row['pp_size']}{seq}, {batches} "
            f"per process, checkpointing {row['activation_checkpointing']}) {t}").strip()


def branch(shape: Shape, hw: Hardware) -> str:
    """Which branch of the seed's decision tree the model and hardware fall in."""
    usable = hw.device_memory * USABLE_FRACTION
    states = 16 * shape.params  # float32 params + grads + two moments
    if states <= usable:
        out = "the model's training state fits one device -> data parallelism (DDP) or ZeRO-1/2"
    elif 8 * shape.largest_unit > usable:  # its float32 weights and gradient, gathered whole
        out = ("even its largest layer does not fit one device when gathered -> tensor parallelism (within a "
               "machine), or ZeRO with care")
    else:
        out = "the model's training state does not fit one device -> ZeRO-3, pipeline or tensor parallelism"
    if hw.num_machines > 1:
        slow = hw.inter_bw * 4 < hw.intra_bw
        out += ("; slow links between machines -> pipeline parallelism across them, TP/ZeRO within" if slow else
                "; fast links between machines -> data parallelism/ZeRO may span them")
    return out


def explain(rows: list[dict], recommended: int | None, shape: Shape, hw: Hardware, seq_len: int = 0,
            sequence_planned: bool = False) -> list[str]:
    long = (f"; sequences of {seq_len} tokens -> sequence (Ulysses) or context parallelism spread each one's "
            "activations over several devices" if sequence_planned else "")
    lines = [f"Branch: {branch(shape, hw)}{long}."]
    if recommended is None:
        lines.append("No layout fits: more devices, more device memory, a smaller batch or a shorter sequence.")
        return lines
    best = rows[recommended]
    lines.append(f"Recommended: {describe(best)}" + ("" if recommended == 0 else
                 f", the simplest within {TIE:.0%} of the fastest ({layout_name(rows[0])})") + ".")
    if best["pp_size"] > 1:
        lines.append(f"Your script feeds {best['per_process_batch']} samples per process per step (the pipeline "
                     f"splits them into {best['micro_batches']}); pipeline parallelism needs the pipeline-ready loop "
                     "(loss_fn given to prepare, loss = model(x, target=y)).")
    else:
        lines.append(f"Your DataLoader's batch_size: {best['micro_batch_size']} per process" +
                     (f", with gradient_accumulation_steps {best['micro_batches']}" if best["micro_batches"] > 1
                      else "") + f" ({best['per_process_batch']} samples per process per optimizer step).")
    degree = best.get("sp_size", 1) * best.get("cp_size", 1)
    if degree > 1 and seq_len:
        lines.append(f"The {degree} processes of a sequence group get the same samples and keep "
                     f"{sequence_length(seq_len, best.get('sp_size', 1), best.get('cp_size', 1)) // degree} tokens of "
                     "each sequence (the prepared DataLoader cuts them; the loop is unchanged).")
    seen = {family(best)}
    for row in rows:
        name = family(row)
        if name in seen:
            continue
        seen.add(name)
        if row["fits"]:
            lines.append(f"Not {name}: its best, {layout_name(row)}, fits but is slower ({row['step_time_s']:.3g} "
                         f"vs {best['step_time_s']:.3g} s/step).")
        else:
            lines.append(f"Not {name}: none fits ({layout_name(row)} {row['reason']}).")
    return lines


def write_config(result: dict, path, main_process_ip: str | None = None):
    """Save the recommended layout as an accel config (AccelConfig.save) that check_launchable accepts; several
    machines need the address of machine 0 (each machine then sets its own machine_rank)."""
    from accel.config import config_from_dict
    from accel.backends.launchable import check_launchable

    if result["recommended"] is None:
        raise PlanError("--write: no layout fits, nothing to write")
    if result["hardware"]["num_machines"] > 1 and not main_process_ip:
        raise PlanError("--write with --num_machines > 1 needs --main_process_ip (the address of machine 0)")
    row = result["layouts"][result["recommended"]]
    hw = result["hardware"]
    par = {"zero_stage": row["zero_stage"], "tp_size": row["tp_size"], "pp_size": row["pp_size"],
           "offload_optimizer": row["offload"], "offload_params": row["offload"],
           "activation_checkpointing": row["activation_checkpointing"]}
    for name in ("sp_size", "cp_size", "ep_size"):
        if row.get(name, 1) > 1:
            par[name] = row[name]
    if row["pp_size"] > 1:
        par["pp_microbatches"] = row["micro_batches"]
        par["pp_schedule"] = row.get("pp_schedule", "1F1B")
    data = {"num_processes": hw["num_machines"] * hw["num_processes"], "num_machines": hw["num_machines"],
            "main_process_ip": main_process_ip, "mixed_precision": result["mixed_precision"], "parallelism": par}
    if result.get("recipe", {}).get("compile"):
        data["dynamo_backend"] = "inductor"
    if row["gradient_accumulation_steps"] > 1:
        data["gradient_accumulation_steps"] = row["gradient_accumulation_steps"]
    cfg = check_launchable(config_from_dict(data, "accel plan"), "accel plan")
    return cfg.save(path)
