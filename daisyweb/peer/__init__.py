"""The peer process: options, start handshake, data feed and the driver loop.

``run.run_peer`` is the entry; see ``daisyweb/peer/run.py`` for the module map.
"""

from daisyweb.peer.exchange import make_trainer
from daisyweb.peer.options import PeerError, PeerOptions, data_url, options_from_args
from daisyweb.peer.run import run_peer

__all__ = ["PeerError", "PeerOptions", "data_url", "make_trainer",
           "options_from_args", "run_peer"]
