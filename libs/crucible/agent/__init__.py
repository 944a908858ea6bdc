"""The agent's interface to the world: byte tokenizer, tool-call grammar and the action format."""
