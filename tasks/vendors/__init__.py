"""Everything that speaks HTTP to vendors. Nothing outside this package imports httpx for that."""
