"""Tool calling and reasoning for /v1/chat/completions, text only: no tensors, no Ray.

By job: `events` (what a parser reads out of generated text), `tagged` (the streaming
machine every marker-delimited call format shares), `calls` (a call object read into a
name and arguments), `hermes`, `llama`, `mistral` (each format's call bodies), `harmony`
(gpt-oss's channels: thinking and calls), `registry` (parsers by name, and the ones a
chat template implies), `reasoning` (`<think>` split from the answer), `forced`
(tool_choice required or named: the JSON schema the output is decoded under, and its
reading; strict tools' structural tag), `message` (a choice's events as OpenAI's message
and stream deltas), `template` (a model's or an adapter's chat template and parsers,
rendering a conversation with tools, the parser a request reads its answer with).
"""
