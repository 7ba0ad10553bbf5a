"""The peer process: options, start handshake, data feed and the driver loop."""
