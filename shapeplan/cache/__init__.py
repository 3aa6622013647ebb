"""`shapeplan cache`: what a warmed cache dir holds (contents.py), a portable archive of one (archive.py) and its
import on another machine (archive_import.py), a shared store of them (store.py; pulling from it: store_pull.py),
and what cache dirs hold for `cache ls` / `prune` (listing.py)."""
