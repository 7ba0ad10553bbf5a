"""daisyweb: spare machines training one small GPT together (see README.md)."""

from daisyweb import blascore as _blascore

_blascore.apply()  # before anything imports numpy: see daisyweb.blascore
