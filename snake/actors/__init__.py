"""The runtime's actors: one asyncio task each, talking through bounded mailboxes."""
