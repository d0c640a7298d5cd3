"""`swift://container/prefix` stores on python-swiftclient, OpenStack Swift's own API.

`auth` logs in and maps errors, `reads` lists and reads, `upload` writes static large objects.
"""

from dlstore.storage.swift.reads import SwiftStore

__all__ = ["SwiftStore"]
