"""The HTTP front end: the app and its routes, the four dialects, and what they share.

The app (`app`: instance management, events, diagrams, health and metrics, and the dialects' routes),
OpenAI's chat, text completions and Responses and Anthropic's Messages (`chat`, `completions`,
`responses_api`, `messages`), one generation as every dialect needs it (`generation`), errors in each
dialect's shape (`errors`), the dashboard (`dashboard`), the HTTP server's limits (`http_server`),
Prometheus (`metrics`), requests forwarded to the controller from a follower node (`forward`) and the
SIGTERM gate (`drain`).

It talks to the daemon only through the controller's public surface and the request book; nothing imports
it but the shell (`exod.serve`, `exod.cli`).
"""
