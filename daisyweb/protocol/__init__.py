"""The group protocol: typed wire messages and their codec, framing, the step machine, averaging."""
