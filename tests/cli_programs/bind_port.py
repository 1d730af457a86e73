"""Rank 0 binds and listens on MASTER_ADDR:MASTER_PORT, as a rendezvous store would."""

import os
import socket

if __name__ == "__main__" and os.environ["RANK"] == "0":
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(address)
        server.listen()
        print(f"bound {address[1]}", flush=True)
