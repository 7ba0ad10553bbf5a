"""The offline inference kit: one HTML file with a checkpoint's weights, the tokenizer and
the shared JavaScript forward (``static/kit.js``). ``tables`` gives the tokenizer's
character classes as code point ranges, ``build`` assembles the file."""
