"""How the router and the model workers talk: the direct channel, its wire, and the typed messages."""
