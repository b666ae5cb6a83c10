"""Write a byte-level tokenizer directory (one token per UTF-8 byte, like the tiny pool's)
that transformers' ``AutoTokenizer`` loads offline, a byte's id its value: what guidellm (``--tokenizer
kind=huggingface_auto,model=DIR``), aiperf (``--tokenizer DIR``) and ``vllm bench serve``
(``--tokenizer DIR``) need to size prompts without reaching a model hub.

    pip install transformers   # brings the tokenizers library; in the peer tool's venv
    python deploy/make_bytetok.py ./bytetok
"""

from __future__ import annotations

import sys


def byte_chars() -> list[str]:
    """The character byte-level BPE (GPT-2's ``bytes_to_unicode``) writes for each byte, by value:
    a printable byte as itself, the others as the characters from U+0100 on, in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def main(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in enumerate(byte_chars())}  # a byte's token id is its value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: every byte is a token
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.save_pretrained(out_dir)
    ids = fast("héllo")["input_ids"]
    assert ids == list("héllo".encode()) and fast.decode(ids) == "héllo", ids
    print(f"byte-level tokenizer written to {out_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python deploy/make_bytetok.py OUT_DIR")
    main(sys.argv[1])
