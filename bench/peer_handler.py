"""The peer: what a TorchServe user would write on HF transformers. Score: a padded batch with an
attention mask, logits of the last token only. Beam: generate(num_beams=W, num_return_sequences=W,
max_new_tokens=N). Same REST protocol as slm_handler; bench-only (not part of the product).

The archive carries peer.json: {"checkpoint": HF dir or .gguf, "task": {...}} (the checkpoint stays
on disk).
"""

import json
import os

import torch


class HFPeerHandler:
    def initialize(self, ctx) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

        props = ctx.system_properties
        config = json.load(open(os.path.join(props["model_dir"], "peer.json")))
        self.task = config["task"]
        gpu = props.get("gpu_id")
        self.device = torch.device(f"cuda:{gpu}" if gpu is not None and torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.task.get("precision", "bf16") == "bf16" else torch.float32
        where = config["checkpoint"]
        if where.endswith(".gguf"):  # transformers' GGUF loader (the CPU smoke run on SmolLM2)
            folder, name = os.path.split(where)
            self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
            self.tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype)
            self.tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(where, "tokenizer.json"))
        self.model = self.model.to(self.device).eval()
        self.template = self.task.get("prompt_template") or ("{text}" if self.task["task"] == "score" else "{prompt}")
        self.tok.pad_token_id = 0
        self.tok.padding_side = "left"  # the last position is every text's last token
        if self.task["task"] == "score":
            self.labels = [self.tok(label, add_special_tokens=False).input_ids[0] for label in self.task["labels"]]
        self.stop = [self.tok.convert_tokens_to_ids(s) for s in self.task.get("stop", [])]

    @torch.inference_mode()
    def handle(self, data, ctx):
        out = []
        for i, request in enumerate(data):
            body = request.get("body") or request.get("data")
            try:
                body = json.loads(body) if isinstance(body, (bytes, bytearray, str)) else body
                out.append(
                    json.dumps(self.score(body["texts"]) if self.task["task"] == "score" else self.beam(body["prompt"]))
                )
            except (KeyError, TypeError, ValueError) as e:
                ctx.set_response_status(400, "Bad Request", i)
                out.append(json.dumps({"error": str(e)}))
        return out

    def score(self, texts):
        texts = [self.template.replace("{text}", t) for t in texts]
        batch = self.tok(texts, padding=True, return_tensors="pt").to(self.device)
        logits = self.model(**batch, logits_to_keep=1).logits[:, -1, self.labels].float()
        return {"labels": self.task["labels"], "scores": torch.softmax(logits, -1).tolist()}

    def beam(self, prompt):
        batch = self.tok([self.template.replace("{prompt}", prompt)], return_tensors="pt").to(self.device)
        w, n = self.task["beam_width"], self.task["new_tokens"]
        out = self.model.generate(
            **batch,
            num_beams=w,
            num_return_sequences=w,
            max_new_tokens=n,
            do_sample=False,
            early_stopping=True,
            length_penalty=0.0,
            eos_token_id=self.stop or None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        # as slm answers: each candidate's tokens up to and including its stop token, no padding after
        new = [
            ids[: next((i + 1 for i, t in enumerate(ids) if t in self.stop), len(ids))]
            for ids in out.sequences[:, batch["input_ids"].shape[1] :].tolist()
        ]
        return {
            "candidates": [
                {"text": self.tok.decode(ids, skip_special_tokens=True), "token_ids": ids, "score": s}
                for ids, s in zip(new, out.sequences_scores.tolist())
            ]
        }
