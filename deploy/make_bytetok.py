"""Write a byte-level tokenizer directory (one token per UTF-8 byte, like the tiny pool's)
that transformers' ``AutoTokenizer`` loads offline: what guidellm (``--tokenizer
kind=huggingface_auto,model=DIR``), aiperf (``--tokenizer DIR``) and ``vllm bench serve``
(``--tokenizer DIR``) need to size prompts without reaching a model hub.

    pip install transformers   # brings the tokenizers library; in the peer tool's venv
    python deploy/make_bytetok.py ./bytetok
"""

from __future__ import annotations

import sys


def main(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: every byte is a token
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.save_pretrained(out_dir)
    ids = fast("héllo")["input_ids"]
    assert len(ids) == len("héllo".encode()) and fast.decode(ids) == "héllo", ids
    print(f"byte-level tokenizer written to {out_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python deploy/make_bytetok.py OUT_DIR")
    main(sys.argv[1])
