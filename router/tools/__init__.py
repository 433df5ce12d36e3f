"""Tool calling and reasoning for /v1/chat/completions, text only: no tensors, no Ray.

By job: `events` (what a parser reads out of generated text), `tagged` (the streaming
machine every marker-delimited call format shares), `hermes`, `llama`, `mistral` (each
format's call bodies), `registry` (parsers by name, and the one a chat template implies),
`reasoning` (thinking split from the answer), `forced` (tool_choice required or named:
the JSON schema the output is decoded under, and its reading), `message` (a choice's
events as OpenAI's message and stream deltas), `template` (a model's or an adapter's chat
template and parsers, and rendering a conversation with tools).
"""
