"""The prompt cleaning Wan's UMT5 tokenizer side applies to every text it encodes (torch-free).

Both families' upstreams run it before UMT5: DreamZero through Wan's tokenizer (``clean="whitespace"``) on its
rendered prompt and negative prompt, LingBot-VA through diffusers' Wan ``prompt_clean`` on the reset prompt and its
negative ``""``.
"""

from __future__ import annotations

import html

import ftfy
import regex


def clean_prompt(text: str) -> str:
    """Upstream's tokenizer-side cleaning (``whitespace_clean(basic_clean(text))``), applied to every text it encodes."""
    text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    # Upstream's `re` is the `regex` module (\s = Unicode White_Space); `regex` comes with transformers.
    return regex.sub(r"\s+", " ", text).strip()
