"""Deterministic test corpus for the tokenizer parity tests (>= 1,000 strings)."""
from __future__ import annotations

import random

FIXED = [
    "", " ", "  ", "   ", "\n", "\n\n", "\n\n\n", "\t", "\t\t", "\r\n", " \n ", "a", "A", ".",
    "Hello world", "Hello, world!", "  leading spaces", "trailing spaces   ", "mid   spaces  here",
    "don't I'm you're we've they'll she'd it's", "''''", "'s 'S 'Ll", "DON'T SHOUT",
    "12345678901234567890", "3.14159", "1,000,000.00", "-42", "+1 (555) 010-0199", "0x1F 0b1010 1e-9",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2  # comment\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "if __name__ == '__main__':\n    main()\n",
    "SELECT * FROM t WHERE a <> 'b' AND c >= 3;",
    "https://example.com/path?q=1&r=two#frag", "user.name+tag@example.org",
    "café naïve résumé façade jalapeño", "Straße Öl Ärger über", "ǅ ǈ ǋ ﬁ ﬂ",
    "你好，世界！", "こんにちは世界。カタカナ", "안녕하세요 세계", "Привет, мир!", "Γειά σου Κόσμε",
    "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Xin chào thế giới",
    "😀😃😄 👍🏽 ❤️", "👨‍👩‍👧‍👦 family", "🇫🇷🇯🇵 flags", "e\u0301 combining", "zero\u200bwidth",
    "nbsp\u00a0here", "ideographic\u3000space", "em\u2003space", "line\u2028sep",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<bos>hello<eos>", "<start_of_turn>user\nWhat?<end_of_turn>\n<start_of_turn>model\n",
    "text<|endoftext|>more", "<|im_start|<|im_end|>>", "<bo s> <|im_start", "<<bos>>",
    "<table><tr><td>1</td></tr></table>", "<h1>Title</h1><strong>bold</strong>",
    "\n" * 40, "\t" * 35, " " * 50, "a" * 300, "ab" * 150, "😀" * 20, "你" * 60,
    "word " * 40, "x\n" * 30, "mixed\t\ttabs\nand\r\nnewlines\n\n\nend",
    "[multimodal]", "<unused0> <unused99>", "<mask><pad><unk>",
    "\u0000nul", "\u007fdel", "\u00ad soft hyphen", "\ufeffbom", "\ufffd replacement",
]

_POOLS = {
    "ascii_words": "the of and to in is was for on are with as I his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most people "
    "my over know water than call first who may down side been now find".split(),
    "code": ["()", "{}", "[]", "=>", "->", "::", "!=", "==", "+=", "&&", "||", "/*", "*/", "//",
             "#include", "std::vector<int>", "self.x", "np.array", "λ", "0xFF", "i++", "`cmd`",
             "$HOME", "%d", "\\n", "\\\\", "\"q\"", "'c'", ";", ":"],
    "numbers": ["0", "7", "42", "123", "2024", "3.5", "1e10", "99.99%", "1/2", "½", "²", "٣", "五"],
    "accents": ["é", "è", "ê", "ë", "à", "ç", "ñ", "ø", "å", "ü", "ß", "œ", "ł", "ő", "ž", "ť"],
    "cjk": ["中", "文", "字", "日本語", "漢字", "한국어", "ひらがな", "カタカナ", "。", "、", "「", "」"],
    "emoji": ["😀", "🎉", "🚀", "👍", "🏽", "❤️", "✨", "🔥", "👩‍💻", "🇩🇪", "☃", "⚡"],
    "ws": [" ", "  ", "\n", "\n\n", "\t", " \t ", "\r\n", "   \n", "\u00a0", "\u3000"],
    "specials": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>",
                 "<start_of_turn>", "<end_of_turn>", "<pad>", "<table>", "</td>", "\n\n\n\n\n"],
    "punct": [".", ",", "!", "?", "...", "—", "–", "-", "'", "\"", "(", ")", "«", "»", "¿", "¡", "…"],
}

_RANGES = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
           (0x900, 0x97F), (0xE00, 0xE7F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
           (0x1F300, 0x1F64F), (0x2000, 0x206F), (0x1D400, 0x1D7FF)]


def _random_chars(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        lo, hi = rng.choice(_RANGES)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def make_corpus(n_random: int = 1000, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    items = list(FIXED)
    kinds = list(_POOLS)
    for i in range(n_random):
        style = i % 5
        if style == 4:
            s = _random_chars(rng, rng.randint(1, 40))
        else:
            parts = []
            for _ in range(rng.randint(1, 25)):
                kind = rng.choice(kinds) if style != 0 else rng.choice(["ascii_words", "punct", "ws"])
                if kind == "specials" and rng.random() < 0.6:
                    kind = "ascii_words"
                parts.append(rng.choice(_POOLS[kind]))
                if rng.random() < 0.5:
                    parts.append(" ")
            s = "".join(parts)
            if rng.random() < 0.2:
                s = s.capitalize()
            if rng.random() < 0.1:
                s = " " + s
        items.append(s)
    return items
