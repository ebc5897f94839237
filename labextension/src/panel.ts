/**
 * The "GPUs" sidebar panel: the user's kernels, named by their notebook (size, state, idle time,
 * GPU use, checkpoint size) with hibernate / resume buttons, a hibernated one's Discard… (asked
 * first), and the checkpoint space they take against the user's quota; every GPU with live meters of its
 * use and memory (a short history kept here, one sample per poll) and its slices drawn as parts
 * of it (an admin sees whose; a user sees their own and the other users' share as one part);
 * for admins, the GPU time released by hibernation with its trend. The notebook names come
 * from the sessions API; GPUs and totals are fetched only while the panel is visible.
 */
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { DeviceModel as Device, deviceLabel, History, memoryMeter, Meter, releasedText, sparklineSvg, utilizationMeter } from './meters';
import {
  ElasticKernel,
  formatGpuHours,
  Fetcher,
  formatBytes,
  formatMib,
  KernelPoller,
  kernelLabel,
  stateText
} from './model';

/** A GPU board: the sidebar tab's icon. */
export const gpuIcon = new LabIcon({
  name: 'jupyter-elastic-kernels:gpu',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">' +
    '<g class="jp-icon3" fill="#616161">' +
    '<path d="M2 6h18a2 2 0 0 1 2 2v8a2 2 0 0 1-2 2h-7v2h-2v-2H4v2H2z"/>' +
    '</g><g class="jp-icon-contrast0" fill="#fff">' +
    '<circle cx="8.5" cy="12" r="3"/><rect x="14" y="9" width="5" height="1.6"/>' +
    '<rect x="14" y="11.2" width="5" height="1.6"/><rect x="14" y="13.4" width="5" height="1.6"/>' +
    '</g></svg>'
});

export class GpusPanel extends Widget {
  private admin: {
    user?: string | null;
    admin: boolean;
    gpu_hours_released: Record<string, number> | null;
    gpus_released_now?: number | null;
  } | null = null;
  /** Samples per GPU ("<uuid>:util", "<uuid>:memory") and of the released total ("released"). */
  readonly history = new History(40);
  private devices: Device[] = [];
  /** kernel id -> notebook path, from `GET /api/sessions`. */
  private notebooks = new Map<string, string>();
  /** The user's checkpoint space, from `GET /api/elastic/storage` (null until it answers). */
  private storage: { used_bytes: number; quota_bytes: number | null } | null = null;

  constructor(
    private poller: KernelPoller,
    private fetcher: Fetcher,
    private openNotebookOf: (kernelId: string) => string | undefined = () => undefined,
    private changeSize: ((kernelId: string) => void) | null = null
  ) {
    super();
    this.id = 'jupyter-elastic-kernels-gpus';
    this.addClass('jp-ElasticPanel');
    this.title.icon = gpuIcon;
    this.title.caption = 'GPUs: your GPU kernels, and (for admins) every GPU';
    this.render();
  }

  protected onAfterShow(): void {
    void this.loadAdmin();
  }

  private async loadSessions(): Promise<void> {
    const reply = await this.fetcher('api/sessions');
    if (reply.status !== 200) {
      return;
    }
    const sessions = (await reply.json()) as { path?: string; kernel?: { id?: string } | null }[];
    this.notebooks = new Map(
      sessions.filter(s => s.kernel?.id && s.path).map(s => [s.kernel!.id as string, s.path as string])
    );
  }

  private async loadAdmin(sessions = true): Promise<void> {
    if (sessions) {
      await this.loadSessions();
    }
    const me = await this.fetcher('api/elastic/me');
    if (me.status !== 200) {
      this.render();
      return;
    }
    this.admin = (await me.json()) as typeof this.admin;
    await this.loadStorage();
    const gpus = await this.fetcher('api/elastic/gpus');
    if (gpus.status === 200) {
      this.devices = ((await gpus.json()) as { devices: Device[] }).devices;
      for (const device of this.devices) {
        this.history.push(`${device.uuid}:util`, device.activity?.gpu_utilization ?? null);
        this.history.push(`${device.uuid}:memory`, device.activity?.memory_used_mib ?? null);
      }
    }
    if (this.admin?.admin) {
      this.history.push('released', this.releasedTotal());
    }
    this.render();
  }

  /** The caller's own line of the storage view: the only one for a user, theirs for an admin. */
  private async loadStorage(): Promise<void> {
    const reply = await this.fetcher('api/elastic/storage');
    if (reply.status !== 200) {
      return;
    }
    type Owner = { owner: string; used_bytes: number; quota_bytes: number | null };
    const owners = ((await reply.json()) as { owners: Owner[] }).owners;
    this.storage = (owners.length === 1 ? owners[0] : owners.find(o => o.owner === this.admin?.user)) ?? null;
  }

  /** Discard… : a hibernated kernel and its checkpoint deleted for good, once the user confirms. */
  private async discard(kernel: ElasticKernel): Promise<void> {
    const size = formatBytes(kernel.checkpoint?.bytes) || 'its checkpoint';
    const answer = await showDialog({
      title: 'Discard the hibernated kernel?',
      body:
        `The kernel of ${this.label(kernel.id)} is shut down and its checkpoint (${size}) deleted: ` +
        'its variables cannot be brought back. This frees checkpoint space.',
      buttons: [Dialog.cancelButton({ label: 'Keep' }), Dialog.warnButton({ label: 'Discard' })]
    });
    if (!answer.button.accept) {
      return;
    }
    const reply = await this.fetcher(`api/kernels/${kernel.id}`, { method: 'DELETE' });
    if (reply.status === 204) {
      Notification.success(`Discarded ${this.label(kernel.id)}: ${size} of checkpoint space freed`, {
        autoClose: 5000
      });
    } else {
      const body = (await reply.json()) as { message?: string };
      Notification.error(`Could not discard: ${body.message ?? reply.status}`);
    }
    await this.poller.refresh();
    if (this.isVisible) {
      await this.loadAdmin();
    }
  }

  private async act(kernel: ElasticKernel, action: 'hibernate' | 'resume' | 'cancel'): Promise<void> {
    const reply = await this.fetcher(`api/elastic/kernels/${kernel.id}/${action}`, { method: 'POST' });
    if (reply.status !== 200) {
      const body = (await reply.json()) as { message?: string };
      Notification.error(`Could not ${action === 'cancel' ? 'stop waiting' : action}: ${body.message ?? reply.status}`);
    }
    await this.poller.refresh();
    if (this.isVisible) {
      await this.loadAdmin();
    }
  }

  /**
   * After a poll, while the panel is visible: the GPUs' use (one more sample of their history),
   * the slices and the totals; the sessions (notebook names) too, but only when a kernel came,
   * went or changed state.
   */
  update_(): void {
    if (!this.isVisible || !this.poller.reachable) {
      this.render();
      return;
    }
    const signature = [...this.poller.kernels.values()].map(k => `${k.id}:${k.state}`).join(',');
    const sessions = signature !== this.signature;
    this.signature = signature;
    void this.loadAdmin(sessions);
  }

  private signature = '';

  private releasedTotal(): number {
    return Object.values(this.admin?.gpu_hours_released ?? {}).reduce((sum, hours) => sum + hours, 0);
  }

  private label(kernelId: string): string {
    const open = this.openNotebookOf(kernelId);
    const known = open ? new Map([[kernelId, open]]) : this.notebooks;
    return kernelLabel(kernelId, known);
  }

  render(): void {
    const node = this.node;
    node.replaceChildren();
    const heading = document.createElement('h3');
    heading.textContent = 'My GPU kernels';
    node.appendChild(heading);
    if (!this.poller.reachable) {
      const away = document.createElement('p');
      away.className = 'jp-ElasticPanel-unreachable';
      const since = this.poller.lastAnswer ? new Date(this.poller.lastAnswer).toLocaleTimeString() : '?';
      away.textContent = `Server unreachable: what follows is as it was at ${since}; actions come back when it answers.`;
      node.appendChild(away);
    }
    if (this.storage) {
      const space = document.createElement('p');
      space.className = 'jp-ElasticPanel-storage';
      const { used_bytes: used, quota_bytes: quota } = this.storage;
      space.dataset.used = String(used);
      space.textContent =
        quota === null
          ? `Checkpoints: ${formatBytes(used) || '0 B'}`
          : `Checkpoints: ${formatBytes(used) || '0 B'} of your ${formatBytes(quota)}`;
      space.title = 'Checkpoint space your kernels take; Discard… a hibernated kernel you no longer need to free it';
      node.appendChild(space);
    }
    const mine = [...this.poller.kernels.values()].filter(k => k.profile);
    if (!mine.length) {
      const empty = document.createElement('p');
      empty.textContent = 'No kernel with a GPU size.';
      node.appendChild(empty);
    }
    const list = document.createElement('div');
    list.className = 'jp-ElasticPanel-kernels';
    for (const kernel of mine) {
      list.appendChild(this.kernelRow(kernel));
    }
    node.appendChild(list);
    if (this.devices.length) {
      const h = document.createElement('h3');
      h.textContent = this.admin?.admin ? 'All GPUs (admin)' : 'GPUs';
      node.appendChild(h);
      for (const device of this.devices) {
        node.appendChild(this.deviceView(device));
      }
    }
    if (this.admin?.admin) {
      const released = Object.entries(this.admin.gpu_hours_released ?? {});
      const total = this.releasedTotal();
      const r = document.createElement('div');
      r.className = 'jp-ElasticPanel-released';
      r.dataset.hours = String(total);
      r.dataset.gpusNow = String(this.admin.gpus_released_now ?? '');
      r.title = released.map(([size, hours]) => `${size}: ${formatGpuHours(hours)}`).join('\n');
      const words = document.createElement('span');
      words.className = 'jp-ElasticPanel-releasedText';
      words.textContent = releasedText(total, this.admin.gpus_released_now);
      const trend = this.sparkline('released', Math.max(...this.history.get('released').map(v => v ?? 0), 1e-9));
      trend.title = 'GPU time released, over the last samples';
      r.append(words, trend);
      node.appendChild(r);
    }
  }

  private sparkline(key: string, max: number): HTMLElement {
    const box = document.createElement('span');
    box.className = 'jp-ElasticPanel-spark';
    box.dataset.series = key;
    box.dataset.samples = String(this.history.get(key).length);
    const values = this.history.get(key);
    // The line spans the box once a few samples are in, and keeps moving left as they come.
    box.innerHTML = sparklineSvg(values, max, Math.max(values.length, 10), key === 'released' ? 160 : 80);
    return box;
  }

  /** A labelled meter: the bar of the latest value, its words, and the history beside it. */
  private meterView(kind: 'util' | 'memory', meter: Meter, key: string, max: number): HTMLElement {
    const row = document.createElement('div');
    row.className = 'jp-ElasticPanel-meter';
    row.dataset.kind = kind;
    row.dataset.fraction = meter.fraction === null ? '' : String(meter.fraction);
    const label = document.createElement('span');
    label.className = 'jp-ElasticPanel-meterText';
    label.textContent = meter.text;
    const bar = document.createElement('span');
    bar.className = 'jp-ElasticPanel-meterBar';
    const fill = document.createElement('span');
    fill.className = 'jp-ElasticPanel-meterFill';
    fill.style.width = `${(meter.fraction ?? 0) * 100}%`;
    bar.appendChild(fill);
    row.append(label, bar, this.sparkline(key, max));
    return row;
  }

  private kernelRow(kernel: ElasticKernel): HTMLElement {
    const row = document.createElement('div');
    row.className = 'jp-ElasticPanel-kernel';
    row.dataset.kernelId = kernel.id;
    row.dataset.state = kernel.state;
    const util = kernel.activity.gpu_utilization;
    // GPU use only of a running kernel: a hibernated one holds no GPU (its last sample is stale).
    const use =
      kernel.state !== 'running'
        ? []
        : [
            util === null || util === undefined ? '' : `GPU ${Math.round(util)}%`,
            formatMib(kernel.activity.gpu_memory_mib)
          ].filter(Boolean);
    const bytes = kernel.checkpoint?.bytes;
    const details = [kernel.profile ?? '', stateText(kernel), ...use];
    if (bytes) {
      details.push(`checkpoint ${formatBytes(bytes)}`);
    }
    const text = document.createElement('div');
    text.className = 'jp-ElasticPanel-kernelText';
    const name = document.createElement('div');
    name.className = 'jp-ElasticPanel-kernelName';
    name.textContent = this.label(kernel.id);
    name.title = `kernel ${kernel.id}`;
    const info = document.createElement('div');
    info.className = 'jp-ElasticPanel-kernelInfo';
    info.textContent = details.join(' · ');
    text.append(name, info);
    const button = document.createElement('button');
    button.className = 'jp-mod-styled jp-ElasticPanel-action';
    if (kernel.state === 'running') {
      button.textContent = 'Hibernate';
      button.onclick = () => void this.act(kernel, 'hibernate');
    } else if (kernel.state === 'hibernated') {
      button.textContent = 'Resume';
      button.onclick = () => void this.act(kernel, 'resume');
    } else if (kernel.state === 'resuming' && kernel.resume?.phase === 'waiting_for_slice') {
      // The wait is the user's to give up: the kernel stays hibernated, no slice taken later.
      button.textContent = 'Cancel';
      button.title = 'Stop waiting for a GPU slice: the kernel stays hibernated (its variables kept)';
      button.onclick = () => void this.act(kernel, 'cancel');
    } else {
      button.textContent = '…';
      button.disabled = true;
    }
    button.disabled ||= !this.poller.reachable;
    const actions = document.createElement('div');
    actions.className = 'jp-ElasticPanel-actions';
    actions.appendChild(button);
    if (this.changeSize && ['running', 'hibernated'].includes(kernel.state)) {
      const resize = document.createElement('button');
      resize.className = 'jp-mod-styled jp-ElasticPanel-action jp-ElasticPanel-resize';
      resize.textContent = 'Size…';
      resize.title = 'Change GPU size: hibernate, then resume at another size (variables kept)';
      resize.onclick = () => this.changeSize?.(kernel.id);
      resize.disabled = !this.poller.reachable;
      actions.appendChild(resize);
    }
    if (kernel.state === 'hibernated') {
      const discard = document.createElement('button');
      discard.className = 'jp-mod-styled jp-ElasticPanel-action jp-ElasticPanel-discard';
      discard.textContent = 'Discard…';
      discard.title = 'Shut this kernel down and delete its checkpoint (its variables) to free space: asked first';
      discard.onclick = () => void this.discard(kernel);
      discard.disabled = !this.poller.reachable;
      actions.appendChild(discard);
    }
    row.append(text, actions);
    return row;
  }

  /** One GPU: its name, a bar with one segment per slice, and the slices in words. */
  private deviceView(device: Device): HTMLElement {
    const box = document.createElement('div');
    box.className = 'jp-ElasticPanel-device';
    box.dataset.uuid = device.uuid;
    const used = Math.round((device.used_fraction ?? 0) * 100);
    const title = document.createElement('div');
    title.className = 'jp-ElasticPanel-deviceName';
    title.textContent = `${deviceLabel(device)} · ${used}% allocated`;
    title.title = device.uuid;
    const bar = document.createElement('div');
    bar.className = 'jp-ElasticPanel-bar';
    const names: string[] = [];
    for (const slice of device.slices ?? []) {
      const who = slice.warm ? 'warm pod' : this.label(slice.kernel_id);
      const segment = document.createElement('div');
      segment.className = 'jp-ElasticPanel-slice';
      segment.dataset.profile = slice.profile ?? '';
      segment.dataset.warm = slice.warm ? 'true' : 'false';
      segment.style.width = `${Math.max(0, Math.min(1, slice.fraction ?? 0)) * 100}%`;
      segment.title = `${slice.profile ?? '?'} · ${who}`;
      segment.textContent = slice.profile ?? '';
      bar.appendChild(segment);
      names.push(`${slice.profile ?? '?'} (${who})`);
    }
    const others = device.other_users;
    if (others && others.slices) {
      const segment = document.createElement('div');
      segment.className = 'jp-ElasticPanel-slice jp-ElasticPanel-others';
      segment.dataset.profile = '';
      segment.style.width = `${Math.max(0, Math.min(1, others.fraction)) * 100}%`;
      segment.title = `other users: ${others.slices} slice(s)`;
      bar.appendChild(segment);
      names.push(`other users (${others.slices})`);
    }
    const words = document.createElement('div');
    words.className = 'jp-ElasticPanel-sliceList';
    words.textContent = names.length ? names.join(', ') : 'no slices';
    box.append(
      title,
      bar,
      words,
      this.meterView('util', utilizationMeter(device), `${device.uuid}:util`, 100),
      this.meterView('memory', memoryMeter(device), `${device.uuid}:memory`, device.memory_mib ?? 0)
    );
    return box;
  }
}
