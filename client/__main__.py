"""``python -m ardiff_client``: the ``ardiff-client`` command."""

from ardiff_client.replay import main

if __name__ == "__main__":
    raise SystemExit(main())
