"""gRPC plumbing every pdplane server and client shares: channels, servers, health and reflection
(`util`), token auth (`auth`), bounded decoding of messages (`message_check`), reflection
(`reflection`), bounded echoes of caller input in statuses (`echo`)."""
