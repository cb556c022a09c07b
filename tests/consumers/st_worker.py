"""sentence-transformers' `SentenceTransformerTrainer`, unchanged, on a tiny BERT built from a config (saved by the main
process to a local folder with an in-memory word tokenizer, then loaded by `SentenceTransformer(folder)`: Transformer
+ mean pooling), in-memory `datasets.Dataset`s, 2 epochs, logging every step, evaluating every few steps.

Scenarios (`--scenarios`, comma-separated):
  mnrl_nodup   MultipleNegativesRankingLoss wrapped in MatryoshkaLoss, (anchor, positive) pairs, the NO_DUPLICATES batch
               sampler (sets `accelerator.even_batches = False` for its training loader), a SequentialEvaluator of
               TripletEvaluator + EmbeddingSimilarityEvaluator
  cosine       CosineSimilarityLoss on scored pairs, an eval dataset (eval loss) and EmbeddingSimilarityEvaluator
  triplet      TripletLoss on (anchor, positive, negative), gradient accumulation 2, TripletEvaluator
  contrastive  ContrastiveLoss on labelled pairs, BinaryClassificationEvaluator, warm-up and cosine schedule

Rank 0 writes <out>/records.json (per scenario: every logged entry's numbers) and <out>/<scenario>.safetensors (the
final weights of the SentenceTransformer)."""

from __future__ import annotations

from pathlib import Path

import torch
from _common import Sentences, listing, numbers, run_scenarios, shared_folder, tokenizer, vocab_size


def build_model(folder: Path):
    from sentence_transformers import SentenceTransformer
    from transformers import BertConfig, BertModel

    def write(folder: Path) -> None:
        torch.manual_seed(0)
        config = BertConfig(vocab_size=vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=64)
        BertModel(config).save_pretrained(folder)
        tokenizer(bert=True).save_pretrained(folder)

    return SentenceTransformer(shared_folder(folder, write), device="cpu")


def pairs(n: int, seed: int) -> dict:
    s = Sentences(seed)
    anchors, positives, negatives, scores, labels, others = [], [], [], [], [], []
    for i in range(n):
        t = s.topic()
        other = (t + 1 + s.rng.randrange(3)) % 4
        anchors.append(s.sentence(t))
        positives.append(s.sentence(t))
        negatives.append(s.sentence(other))
        same = i % 2 == 0
        others.append(s.sentence(t if same else other))
        labels.append(int(same))
        scores.append(0.9 if same else 0.1)
    return {"anchor": anchors, "positive": positives, "negative": negatives, "other": others, "score": scores,
            "label": labels}


def train(out: Path, loss_fn, columns: list, evaluator_fn, eval_columns=None, **overrides):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    model = build_model(out / "tiny-bert")
    data, held_out = pairs(48, 1), pairs(16, 2)
    train_dataset = Dataset.from_dict({c: data[c] for c in columns})
    eval_dataset = Dataset.from_dict({c: held_out[c] for c in (eval_columns or columns)}) if eval_columns else None
    base = dict(num_train_epochs=2, per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=5e-4,
                logging_steps=1, eval_strategy="steps", eval_steps=4, save_strategy="no", report_to=[], seed=42,
                use_cpu=True, disable_tqdm=True)
    args = SentenceTransformerTrainingArguments(str(out), **{**base, **overrides})
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                                         loss=loss_fn(model), evaluator=evaluator_fn(held_out))
    trainer.train()
    log = [numbers(e) for e in trainer.state.log_history]
    weights = {k: v for k, v in trainer.model.state_dict().items()}
    final = evaluator_fn(held_out)(trainer.model)
    return {"log": log, "final_eval": numbers(final), "even_batches": trainer.accelerator.even_batches,
            "files": listing(out)}, {"": weights}


def mnrl_nodup(out: Path):
    from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    from sentence_transformers.sentence_transformer import evaluation, losses

    def evaluator(d):
        return evaluation.SequentialEvaluator([
            evaluation.TripletEvaluator(d["anchor"], d["positive"], d["negative"], name="triplet"),
            evaluation.EmbeddingSimilarityEvaluator(d["anchor"], d["other"], d["score"], name="sts")])

    return train(out, lambda m: losses.MatryoshkaLoss(m, losses.MultipleNegativesRankingLoss(m), [32, 16]),
                 ["anchor", "positive"], evaluator, batch_sampler=BatchSamplers.NO_DUPLICATES)


def cosine(out: Path):
    from sentence_transformers.sentence_transformer import evaluation, losses

    return train(out, losses.CosineSimilarityLoss, ["anchor", "other", "score"],
                 lambda d: evaluation.EmbeddingSimilarityEvaluator(d["anchor"], d["other"], d["score"], name="sts"),
                 eval_columns=["anchor", "other", "score"])


def triplet(out: Path):
    from sentence_transformers.sentence_transformer import evaluation, losses

    return train(out, losses.TripletLoss, ["anchor", "positive", "negative"],
                 lambda d: evaluation.TripletEvaluator(d["anchor"], d["positive"], d["negative"], name="triplet"),
                 gradient_accumulation_steps=2, eval_steps=2)


def contrastive(out: Path):
    from sentence_transformers.sentence_transformer import evaluation, losses

    return train(out, losses.ContrastiveLoss, ["anchor", "other", "label"],
                 lambda d: evaluation.BinaryClassificationEvaluator(d["anchor"], d["other"], d["label"], name="bin"),
                 warmup_steps=2, lr_scheduler_type="cosine")


if __name__ == "__main__":
    run_scenarios({"mnrl_nodup": mnrl_nodup, "cosine": cosine, "triplet": triplet, "contrastive": contrastive},
                  __doc__)
