"""The bench's yardstick for archway's extender: a minimal Go scheduler extender in which every
node passes (lab/cluster/go/passall-extender/main.go, built with the Go toolchain that builds
Kubernetes, cached). Figures 19c and 25j point the same kube-scheduler at it and at archway's
extender, so the ratio of their bind rates is what archway's own serving costs the scheduler."""
import os

import yaml

from lab.cluster.controlplane import ControlPlane
from lab.cluster.nodeimages import go_binary
from lab.procs import Server, free_port


class PassAllExtender:
    """The Go pass-all extender on 127.0.0.1; `url` is a KubeSchedulerConfiguration urlPrefix."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/scheduler"
        self.server = Server([go_binary("passall-extender"), f"127.0.0.1:{self.port}"],
                             port=self.port, log_path=os.path.join(directory, "passall-extender.log"))

    def stop(self) -> None:
        self.server.stop()


def extender_url(plane: ControlPlane, process: str) -> str:
    """The urlPrefix of the (one) extender in the saved configuration of scheduler `process`."""
    with open(plane.path(f"{process}.config.yaml")) as f:
        (extender,) = yaml.safe_load(f)["extenders"]
    return extender["urlPrefix"]


def point_extender(plane: ControlPlane, process: str, url: str) -> None:
    """Scheduler `process`'s saved configuration with its extender at `url`, all else kept:
    its next (re)start calls that extender."""
    path = plane.path(f"{process}.config.yaml")
    with open(path) as f:
        config = yaml.safe_load(f)
    (extender,) = config["extenders"]
    extender["urlPrefix"] = url
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
