"""Tests of exporter/host/kube.py."""


def test_mount_labels_of_each_runtime():
    from exporter.host.kube import mount_labels
    uid, cid = "0f1e2d3c-aaaa-bbbb-cccc-001122334455", "ab" * 32
    assert mount_labels(f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/dshm") == {
        "pod_uid": uid, "volume": "dshm", "container_id": ""}
    for path in (f"/run/containerd/io.containerd.grpc.v1.cri/sandboxes/{cid}/shm",
                 f"/var/lib/containers/storage/overlay-containers/{cid}/userdata/shm",
                 f"/var/lib/docker/containers/{cid}/mounts/shm"):
        assert mount_labels(path) == {"pod_uid": "", "volume": "", "container_id": cid}, path
    assert mount_labels("/dev/shm") is None
    assert mount_labels(f"/var/lib/docker/containers/{cid}/mounts/shm/sub") is None


def test_pod_uid_in_cgroup_both_drivers():
    from exporter.host.kube import pod_uid_in_cgroup
    uid = "0f1e2d3c-aaaa-bbbb-cccc-000000000001"
    assert pod_uid_in_cgroup(f"/kubepods/burstable/pod{uid}/cri-containerd-abc.scope") == uid
    systemd = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + uid.replace("-", "_") + ".slice"
    assert pod_uid_in_cgroup(systemd) == uid  # underscores back to dashes
    text = f"12:memory:/kubepods/pod{uid}/c1\n11:cpu:/kubepods/pod{uid}/c1\n0::/\n"
    assert pod_uid_in_cgroup(text) == uid  # /proc/<pid>/cgroup, several lines
    assert pod_uid_in_cgroup("/system.slice/docker-abc.scope") == ""
    assert pod_uid_in_cgroup("/kubepods/pod0F1E2D3C-AAAA-BBBB-CCCC-000000000001") == ""  # not a kubelet UID
    assert pod_uid_in_cgroup(f"/kubepods/pod{uid[:-1]}") == ""  # one hex digit short
    assert pod_uid_in_cgroup(f"/kubepods/{uid}") == ""  # no "pod" prefix
