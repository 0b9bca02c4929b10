"""The HTTP gateway: the IM and runtime gRPC APIs as JSON and Server-Sent Events, and the web UI."""
