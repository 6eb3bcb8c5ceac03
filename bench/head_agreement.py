"""Benchmark: how often the draft's top-1 equals the target's, teacher-forced, on two kinds of text.

Separates "the head is weak" from "the head was trained on other text": the same exported
head is scored on held-out ShareGPT replies (the training distribution; records from the
end of the file, never in the recipe's samples) and on the target's own greedy answers to
MT-Bench first turns (what it drafts for when serving, taken from a ``lyanna-bench``
run's ``target.jsonl``). For each unroll step j it reports the share of answer positions
where the draft's hot-vocabulary argmax equals the target's full-vocabulary argmax, and
the share of positions whose target top-1 lies in the hot vocabulary at all (a ceiling).

    python bench/head_agreement.py --draft checkpoints/smollm2_135m-export \\
        --answers checkpoints/smollm2_135m/bench/target.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch

from lyanna_train.data.corpus import Corpus, ReadNotes, iter_documents
from lyanna_train.data.features import FeatureExtractor
from lyanna_train.evaluation.prompts import read_questions, render_prompt
from lyanna_train.runtime.served_models import load_models

STEPS = 3


def agreement(target, draft, sequences: list[tuple[list[int], int]]) -> dict:
    """sequences: (ids, first answer position) -> {"positions", "step0".., "in_hot"}."""
    extractor = FeatureExtractor(target, draft.cfg.aux_layer_ids)
    lm_head = target.get_output_embeddings().weight
    hot = torch.zeros(lm_head.shape[0], dtype=torch.bool)
    hot[draft.hot_ids] = True
    agree, positions, in_hot = [0] * STEPS, 0, 0
    for ids, start in sequences:
        ids_t = torch.tensor([ids])
        features = extractor(ids_t)
        with torch.inference_mode():
            target_top1 = (features.last[0] @ lm_head.T).argmax(-1)  # position p predicts x_{p+1}
            outs = draft.forward_unrolled(features.aux, ids_t, STEPS)
        anchors = torch.arange(start - 1, len(ids) - 2 - (STEPS - 1))  # anchor t predicts x_{t+2+j}
        positions += len(anchors)
        in_hot += int(hot[target_top1[anchors + 1]].sum())
        for j, out in enumerate(outs):
            drafted = draft.draft_to_target(out.logits[0, :, :draft.cfg.draft_vocab_size].argmax(-1))
            agree[j] += int((drafted[anchors] == target_top1[anchors + 1 + j]).sum())
    return {"positions": positions, **{f"step{j}": a / positions for j, a in enumerate(agree)},
            "in_hot": in_hot / positions}


def sharegpt_replies(tokenizer, count: int, max_tokens: int) -> list[tuple[list[int], int]]:
    out = []
    for doc in iter_documents(Corpus.resolve(["sharegpt"]), ReadNotes(), keep=lambda i: i >= 17000):
        msgs = getattr(doc, "messages", None)
        if msgs and len(msgs) >= 2 and msgs[0]["role"] == "user" and msgs[1]["role"] == "assistant":
            prompt = render_prompt(tokenizer, msgs[:1])
            answer = tokenizer(msgs[1]["content"], add_special_tokens=False)["input_ids"][:max_tokens]
            if len(prompt) < 400 and len(answer) > 50:
                out.append((prompt + answer, len(prompt)))
        if len(out) == count:
            break
    return out


def own_answers(tokenizer, path: str) -> list[tuple[list[int], int]]:
    questions = {q.question_id: q for q in read_questions("mtbench")}
    out = []
    for line in open(path, encoding="utf-8"):
        rec = json.loads(line)
        prompt = render_prompt(tokenizer, [{"role": "user", "content": questions[rec["question_id"]].turns[0]}])
        out.append((prompt + rec["choices"][0]["token_ids"][0], len(prompt)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", default="checkpoints/smollm2_135m-export")
    p.add_argument("--answers", default="checkpoints/smollm2_135m/bench/target.jsonl",
                   help="a lyanna-bench target.jsonl (MT-Bench): the target's own answers")
    p.add_argument("--sharegpt", type=int, default=32, help="held-out ShareGPT replies")
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    target, tokenizer, draft = load_models(args.draft, None)
    print("| text | positions | " + " | ".join(f"top-1 agreement, step {j}" for j in range(STEPS))
          + " | target top-1 in hot vocab |")
    print("|---|---:|" + "---:|" * (STEPS + 1))
    for name, seqs in (("held-out ShareGPT replies", sharegpt_replies(tokenizer, args.sharegpt, args.max_tokens)),
                       ("the target's own MT-Bench answers", own_answers(tokenizer, args.answers))):
        r = agreement(target, draft, seqs)
        print(f"| {name} | {r['positions']} | " + " | ".join(f"{r[f'step{j}']:.3f}" for j in range(STEPS))
              + f" | {r['in_hot']:.3f} |")


if __name__ == "__main__":
    main()
