"""What a node keeps on its host, beside its launchers: images and the other resources a sandbox
is made from. Plain Python, no Django: a node uses it directly."""
