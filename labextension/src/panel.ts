/**
 * The "GPUs" sidebar panel: the user's kernels (size, state, idle time, GPU use) with
 * hibernate / resume buttons; for admins, every GPU with its slices, and the GPU-hours
 * released by hibernation. Admin data is fetched only while the panel is visible.
 */
import { Notification } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { ElasticKernel, Fetcher, formatMib, KernelPoller, stateText } from './model';

interface Device {
  uuid: string;
  name: string;
  memory_mib?: number;
  used_fraction?: number;
  slices?: { kernel_id: string; profile?: string; fraction?: number; warm?: boolean }[];
}

export class GpusPanel extends Widget {
  private admin: { admin: boolean; gpu_hours_released: Record<string, number> | null } | null = null;
  private devices: Device[] = [];

  constructor(
    private poller: KernelPoller,
    private fetcher: Fetcher
  ) {
    super();
    this.id = 'jupyter-elastic-kernels-gpus';
    this.addClass('jp-ElasticPanel');
    this.title.label = 'GPUs';
    this.title.caption = 'Elastic kernels and GPUs';
    this.render();
  }

  protected onAfterShow(): void {
    void this.loadAdmin();
  }

  private async loadAdmin(): Promise<void> {
    const me = await this.fetcher('api/elastic/me');
    if (me.status !== 200) {
      return;
    }
    this.admin = (await me.json()) as typeof this.admin;
    if (this.admin?.admin) {
      const gpus = await this.fetcher('api/elastic/gpus');
      if (gpus.status === 200) {
        this.devices = ((await gpus.json()) as { devices: Device[] }).devices;
      }
    }
    this.render();
  }

  private async act(kernel: ElasticKernel, action: 'hibernate' | 'resume'): Promise<void> {
    const reply = await this.fetcher(`api/elastic/kernels/${kernel.id}/${action}`, { method: 'POST' });
    if (reply.status !== 200) {
      const body = (await reply.json()) as { message?: string };
      Notification.error(`Could not ${action}: ${body.message ?? reply.status}`);
    }
    await this.poller.refresh();
    if (this.isVisible) {
      await this.loadAdmin();
    }
  }

  /**
   * After a poll: the admin view follows when a kernel changed state (a slice taken or given
   * back), and only while the panel is visible, so the admin data costs nothing otherwise.
   */
  update_(): void {
    const signature = [...this.poller.kernels.values()].map(k => `${k.id}:${k.state}`).join(',');
    if (this.isVisible && this.admin?.admin && signature !== this.signature) {
      this.signature = signature;
      void this.loadAdmin();
      return;
    }
    this.render();
  }

  private signature = '';

  render(): void {
    const node = this.node;
    node.replaceChildren();
    const heading = document.createElement('h3');
    heading.textContent = 'My GPU kernels';
    node.appendChild(heading);
    const mine = [...this.poller.kernels.values()].filter(k => k.profile);
    if (!mine.length) {
      const empty = document.createElement('p');
      empty.textContent = 'No kernel with a GPU size.';
      node.appendChild(empty);
    }
    const list = document.createElement('div');
    list.className = 'jp-ElasticPanel-kernels';
    for (const kernel of mine) {
      const row = document.createElement('div');
      row.className = 'jp-ElasticPanel-kernel';
      row.dataset.kernelId = kernel.id;
      const util = kernel.activity.gpu_utilization;
      // GPU use only of a running kernel: a hibernated one holds no GPU (its last sample is stale).
      const use =
        kernel.state !== 'running'
          ? []
          : [
              util === null || util === undefined ? '' : `GPU ${Math.round(util)}%`,
              formatMib(kernel.activity.gpu_memory_mib)
            ].filter(Boolean);
      const text = document.createElement('div');
      text.className = 'jp-ElasticPanel-kernelText';
      text.textContent = `${kernel.id.slice(0, 8)} · ${kernel.profile} · ${stateText(kernel)}${
        use.length ? ' · ' + use.join(' · ') : ''
      }`;
      const button = document.createElement('button');
      button.className = 'jp-mod-styled jp-ElasticPanel-action';
      if (kernel.state === 'running') {
        button.textContent = 'Hibernate';
        button.onclick = () => void this.act(kernel, 'hibernate');
      } else if (kernel.state === 'hibernated') {
        button.textContent = 'Resume';
        button.onclick = () => void this.act(kernel, 'resume');
      } else {
        button.textContent = '…';
        button.disabled = true;
      }
      row.append(text, button);
      list.appendChild(row);
    }
    node.appendChild(list);
    if (this.admin?.admin) {
      const h = document.createElement('h3');
      h.textContent = 'All GPUs (admin)';
      node.appendChild(h);
      for (const device of this.devices) {
        const p = document.createElement('div');
        p.className = 'jp-ElasticPanel-device';
        const slices = (device.slices ?? []).map(s =>
          s.warm ? `${s.profile ?? '?'} (warm pod)` : `${s.profile ?? '?'} (${s.kernel_id.slice(0, 8)})`
        );
        p.textContent = `${device.name} ${device.uuid}: ${Math.round((device.used_fraction ?? 0) * 100)}% allocated; ${
          slices.length ? slices.join(', ') : 'no slices'
        }`;
        node.appendChild(p);
      }
      const released = Object.entries(this.admin.gpu_hours_released ?? {});
      const total = released.reduce((sum, [, hours]) => sum + hours, 0);
      const r = document.createElement('p');
      r.className = 'jp-ElasticPanel-released';
      r.textContent = `GPU-hours released by hibernation: ${total.toFixed(4)}`;
      node.appendChild(r);
    }
  }
}
