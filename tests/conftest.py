"""Suite-wide safety net: every WebRTC peer a test starts gathers 127.0.0.1 only.

Tests pass ``--ice-host 127.0.0.1`` / ``ice_hosts=[...]`` themselves; this makes a test
that forgets it (and every peer subprocess, which inherits the environment) still keep
its traffic on loopback.
"""

import os

from daisyweb import ice

os.environ[ice.ENV_VAR] = "127.0.0.1"

