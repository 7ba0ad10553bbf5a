"""The network: ICE settings, the signaling client, links and the peer mesh."""
