"""Reads a TensorBoard log folder with TensorBoard's own event reader and prints, as JSON,
every scalar series ({tag: [[step, value], ...]}) and every image ({tag: [[step, width,
height], ...]}): the reference the event-file tests compare the metrics file with."""
import json
import sys

from tensorboard.backend.event_processing import event_accumulator


def main(logdir):
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]}
    images = {t: [[e.step, e.width, e.height] for e in acc.Images(t)] for t in tags["images"]}
    print(json.dumps({"scalars": scalars, "images": images}))


if __name__ == "__main__":
    main(sys.argv[1])
